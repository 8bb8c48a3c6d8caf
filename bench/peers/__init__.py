"""Other inference engines the bench runs beside protoserve on the same machine, model file and prompts."""
