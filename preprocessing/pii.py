"""PII redaction: emails, IPv4 addresses and phone numbers replaced by placeholders."""

from __future__ import annotations

import re

from megalith.config import PIIConfig

EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[a-zA-Z]{2,}\b")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
IPV4 = re.compile(rf"(?<![\d.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\d|\.\d)")
# +1 (555) 123-4567, 555-123-4567, 555.123.4567, +44 20 7946 0958: groups of digits joined
# by a space, dot or dash, ten digits or more in all (dates and sums stay).
PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,4}(?!\w)"
)
KINDS = ("email", "ip", "phone")


def redact(text: str, config: PIIConfig) -> tuple[str, dict[str, int]]:
    """The text with each enabled kind replaced, and the number of matches of each kind."""
    counts: dict[str, int] = {}
    for kind, enabled, pattern, replacement in (
        ("email", config.emails, EMAIL, config.email_replacement),
        ("ip", config.ip_addresses, IPV4, config.ip_replacement),
        ("phone", config.phone_numbers, PHONE, config.phone_replacement),
    ):
        if enabled:
            text, found = pattern.subn(replacement, text)
            if found:
                counts[kind] = found
    return text, counts
