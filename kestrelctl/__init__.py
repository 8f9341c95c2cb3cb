"""kestrelctl: the command-line client and the Python client library for kestreld."""
from .client import Client, KestrelClientError, Progress, Result, Stream, Token

__all__ = ["Client", "KestrelClientError", "Progress", "Result", "Stream", "Token"]
