"""The exit codes of ``protoserve``: a user error prints one line to stderr and exits with one of these.

Scripts and supervisors can tell a mistake to fix (2), a model that will not
load (1) and a port someone else holds (3, as uvicorn uses for a failed
startup) apart without reading the message.
"""

OK = 0
MODEL_LOAD = 1  # the model (path, file, or a flag the model cannot take) could not be loaded
USAGE = 2  # a bad flag or flag value, or a file a flag names that cannot be read (argparse's code)
PORT_UNAVAILABLE = 3  # a port to listen on is taken or not permitted
INTERRUPTED = 130  # Ctrl-C before the server was up (128 + SIGINT)
