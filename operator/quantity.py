"""Kubernetes resource quantities as numbers, for the little arithmetic the builders do on them
(a worker's memory grows by its host KV tier). The API server's grammar: a decimal number (an
exponent allowed) and one suffix, binary (Ki .. Ei), decimal (k .. E) or milli (m)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

GIB = 2**30
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"m": Decimal("0.001"), "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")


def parse_quantity(value: int | float | str) -> Decimal:
    """The quantity's value in its base unit (bytes for memory); ValueError naming what is wrong."""
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 16Gi, 500M, 1073741824)")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from None
    suffix = m.group(2) or ""
    return number * _BINARY.get(suffix, _DECIMAL.get(suffix, 1))


def memory_quantity(nbytes: Decimal | int) -> str:
    """Bytes as the shortest exact quantity: whole Gi or Mi where they divide, else Ki or bytes
    (rounded up to a whole byte: a memory request is never rounded down)."""
    n = int(-(-Decimal(nbytes) // 1))
    for suffix in ("Gi", "Mi", "Ki"):
        if n % _BINARY[suffix] == 0 and n:
            return f"{n // _BINARY[suffix]}{suffix}"
    return str(n)
