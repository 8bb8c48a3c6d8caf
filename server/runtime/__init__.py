"""The process around the services: event loop, ports, health, reflection."""
