"""A loaded model as the API serves it: the served model, the registry of them, the one request-to-sampling mapping."""
