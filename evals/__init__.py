"""Quality (lm-eval) and load evaluation, reports and the dashboard."""
