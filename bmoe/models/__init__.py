"""Models: the GGUF probe, the listing, the catalog, downloads and the Hugging Face client.

Modules: `probe` (the header, pure), `listing` (what the model folders hold), `catalog`
(the shipped entries and the added ones), `curl` (the one way the server reaches the
network: the system curl as a child process), `download` (jobs, retry policy, events),
`hf` (a Hugging Face site or mirror), `verdict` (inspect's machine figures and words),
`service` (the state the routes share).
"""
