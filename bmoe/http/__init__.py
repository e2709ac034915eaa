"""The HTTP layer: h11 on trio, written for bmoe. Knows HTTP, nothing about models.

Modules: ``limits`` (every number, with its unit), ``types`` (Request, Response,
StreamResponse), ``errors`` (HTTPError), ``routes`` (the route table), ``access``
(the security checks), ``sse`` (event-stream encoding), ``static`` (the UI's files),
``connection`` (one connection's life), ``server`` (listening, workers, HttpApp),
``parent`` (``--parent-pid``).
"""
