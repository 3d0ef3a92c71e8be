"""Commands that only the CLI runs (certificates, diagnose)."""
