"""Moved to `bmoe.modelmaker` (the model maker is a tool, not the engine). This name
stays only for code written against the old path; import `bmoe.modelmaker`."""

from bmoe.modelmaker import ensure_demo_model, main_make_model, make_model  # noqa: F401
