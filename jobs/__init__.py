"""Batch jobs on top of the server's request handling: ``triptych run-batch`` (OpenAI's batch
file format) and ``triptych ocr`` (images, folders and PDFs).

Both commands send OpenAI requests to a :class:`~triptych.jobs.backend.Backend`: either the
very FastAPI app ``triptych serve`` runs, driven in this process without a socket, or a
running server (``--server URL``). Everything a request goes through (validation, media,
processor, sampling, response format, errors) is therefore the server's own code, and the
two modes answer alike. See docs/jobs.md.
"""
from __future__ import annotations
