"""The OpenAI-compatible HTTP server over one `AsyncEngine`: protocol, routes (completions, chat,
adapters), error handlers, middleware and the command line."""
