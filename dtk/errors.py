"""How dtk reports errors that come from TensorFlow: one readable line with the root cause.

TensorFlow wraps a failure inside a function as ``N root error(s) found.`` followed by
``(0) CODE: {{function_node ...}} message`` lines; the first line alone says nothing. dtk's errors
quote ``first_line(e)``, which picks the first root cause and drops the function-node noise.
"""

from __future__ import annotations

import re


def first_line(e: BaseException, limit: int = 500) -> str:
    """The first meaningful line of an exception's message (the root cause for TensorFlow's)."""
    text = [t.strip() for t in (getattr(e, "message", None) or str(e)).strip().splitlines()
            if t.strip()]
    if not text:
        return type(e).__name__
    line = text[0]
    if re.search(r"\d+ root error\(s\) found", line):  # also after a code: "RESOURCE_EXHAUSTED: 2 root ..."
        causes = [t for t in text if t.startswith("(0)")]
        line = causes[0][3:].strip() if causes else line
    line = re.sub(r"\{\{[^}]*\}\}\s*", "", line)
    return line[:limit]
