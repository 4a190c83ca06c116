class Fp4kitError(Exception):
    """Bad input or an impossible request: the CLI prints the message as one line and exits with code 2."""
