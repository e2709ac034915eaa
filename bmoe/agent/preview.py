"""The workspace-preview policy: the spec's strings, word for word, and the pick."""

from __future__ import annotations

PREVIEW_MAX_BYTES = 16 * 2**20     # a preview answers files up to this size

POLICY_OFF = ("sandbox allow-scripts; default-src 'none'; script-src 'unsafe-inline'; "
              "style-src 'unsafe-inline'; img-src data: blob:; font-src data:; "
              "media-src data: blob:; connect-src 'none'; object-src 'none'; base-uri 'none'; "
              "form-action 'none'; frame-ancestors 'self'")
POLICY_ON = ("sandbox allow-scripts; default-src 'none'; "
             "script-src 'unsafe-inline' 'unsafe-eval' blob: https:; "
             "style-src 'unsafe-inline' https:; img-src data: blob: https:; font-src data: https:; "
             "media-src data: blob: https:; connect-src https: wss:; worker-src blob: https:; "
             "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'self'")

CHOICES = ("off", "on", "auto")

TYPES = {
    ".html": "text/html; charset=utf-8", ".htm": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8", ".json": "application/json",
    ".svg": "image/svg+xml", ".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
    ".gif": "image/gif", ".webp": "image/webp", ".ico": "image/x-icon",
    ".txt": "text/plain; charset=utf-8", ".md": "text/plain; charset=utf-8",
    ".wasm": "application/wasm", ".woff2": "font/woff2", ".mp3": "audio/mpeg",
    ".mp4": "video/mp4", ".pdf": "application/pdf",
}


def policy(setting: str, loopback_only: bool) -> str:
    """`--preview-network`: on, off, or auto (on when the server listens on loopback only)."""
    on = setting == "on" or (setting == "auto" and loopback_only)
    return POLICY_ON if on else POLICY_OFF


def content_type(suffix: str) -> str:
    """Source files a person previews show as text; unknown ones as bytes."""
    return TYPES.get(suffix.lower(), "text/plain; charset=utf-8" if suffix else
                     "application/octet-stream")


def headers(setting: str, loopback_only: bool) -> list[tuple[str, str]]:
    return [("Content-Security-Policy", policy(setting, loopback_only)),
            ("X-Frame-Options", "SAMEORIGIN"), ("X-Content-Type-Options", "nosniff"),
            ("Referrer-Policy", "no-referrer"), ("Cache-Control", "no-store")]
