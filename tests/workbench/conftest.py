"""Ray, wherever these tests start it (an in-process instance, a `Cluster`'s nodes, a node in a
subprocess), binds and advertises 127.0.0.1 only: the tests open no port on a network."""

from workbench.ray_executor import loopback_only

loopback_only()
