"""Reading the `kvgate-priority` request header: a class number, written plainly.

Only ASCII digits with an optional leading minus are a class. str.isdigit() and int() are
both wider than that: "²" is a digit int() cannot read, "٣" (Arabic-Indic three) is one it
reads as 3, and int() also takes "+1", "1_0" and surrounding whitespace. A header value is
what the client typed, so anything else is refused rather than guessed at.
"""

from __future__ import annotations

import re

# Nine digits bound int()'s work and the number's size; classes are far smaller anyway
# (the tenant's own is -100 to 100), and an unlisted number is refused by the caller.
_PRIORITY_CLASS = re.compile(r"-?[0-9]{1,9}", re.ASCII)


def parse_priority_class(text: str) -> int | None:
    """The class `text` names, or None when it is not a plain decimal integer."""
    if _PRIORITY_CLASS.fullmatch(text) is None:
        return None
    return int(text)
