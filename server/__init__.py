"""The gRPC server: services over the engine (server/app.py), started by server/cli.py."""
