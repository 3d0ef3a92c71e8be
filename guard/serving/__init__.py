"""The gunicorn worker, the server and TLS: connections, deadlines and bounds."""
