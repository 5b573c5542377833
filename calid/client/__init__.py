"""calid client SDK: sync and asyncio gRPC clients for a calid server.

    from calid.client import Client
    with Client("127.0.0.1:50051") as c:
        print(c.generate("Write a haiku about caches", mode="filter").text)
        for chunk in c.stream("Explain KV caches", max_new_tokens=64):
            print(chunk.text, end="", flush=True)

Every call has a deadline (``timeout`` seconds, per call or the client's
default) and a request id (generated when not given). Calls that fail with
UNAVAILABLE are retried with exponential backoff; a stream is retried only
before its first chunk. Failures raise the typed exceptions of
calid.client.errors (InvalidArgument, ResourceExhausted, DeadlineExceeded,
Cancelled, Unavailable, Unauthenticated, NotFound).

A server that requires API keys takes ``Client(..., api_key=KEY)`` (default:
the CALID_API_KEY environment variable); ``tls=True`` or ``tls="ca.pem"``
opens a TLS channel.
"""
from calid.client.errors import (CalidAPIError, Cancelled, DeadlineExceeded, InvalidArgument, NotFound,
                                 ResourceExhausted, Unauthenticated, Unavailable)
from calid.client.sdk import AsyncClient, Chunk, Client, Completion, Logprob

__all__ = ["Client", "AsyncClient", "Completion", "Chunk", "Logprob", "CalidAPIError", "InvalidArgument",
           "ResourceExhausted", "DeadlineExceeded", "Cancelled", "Unavailable", "Unauthenticated", "NotFound"]
