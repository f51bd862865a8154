"""The line protocol of the e2e vLLM runner's ``serve`` mode (the checkout's ``tests/e2e/run_vllm.py``):
each answer to a command is one stdout line, ``REPLY`` then JSON (vLLM's own log lines go to stdout too)."""

__all__ = ["REPLY"]

REPLY = "@@tiercache-reply "
"""Prefix of ``serve``'s answer lines on stdout."""
