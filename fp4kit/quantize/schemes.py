"""Which scheme each quantized module gets.

``--scheme`` names the default; ``--scheme-for REGEX=SCHEME`` rules map module names to another scheme, the first
matching rule winning as in compressed-tensors' ``config_groups``. Modules a kernel fuses (q/k/v, gate/up:
fp4kit.families.base.weight_scale_group) are read as one weight, so they must end up with one scheme. The FP8
schemes' math is fp4kit.fp8's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fp4kit.errors import Fp4kitError

if TYPE_CHECKING:
    from fp4kit.quantize.plan import QuantGroup

NVFP4_SCHEMES = ("nvfp4", "nvfp4a16")
FP8_SCHEMES = ("fp8-dynamic", "fp8-block", "fp8-static")
# schemes whose modules carry a calibrated static input scale
STATIC_INPUT_SCHEMES = ("nvfp4", "fp8-static")
KEPT = "bf16"
# an FP8 Linear of the source kept as stored: its E4M3 weight and its scale, byte for byte (fp4kit.quantize.plan
# StoredFp8); a rule with it also reaches FP8 modules that the ignores leave unquantized
STORED = "fp8-source"
SCHEMES = (*NVFP4_SCHEMES, *FP8_SCHEMES, KEPT, STORED)


@dataclass(frozen=True)
class SchemeRule:
    pattern: re.Pattern[str]
    scheme: str
    spelled: str  # as the user wrote it, for messages


def parse_rule(text: str, what: str = "--scheme-for") -> SchemeRule:
    """``REGEX=SCHEME`` (the regex may carry llm-compressor's ``re:`` prefix); the last ``=`` separates them."""
    pattern, sep, scheme = text.rpartition("=")
    if not sep or not pattern:
        raise Fp4kitError(f"{what} {text!r}: expected REGEX=SCHEME")
    scheme = scheme.strip().lower()
    if scheme not in SCHEMES:
        raise Fp4kitError(f"{what} {text!r}: unknown scheme {scheme!r} (choose from {', '.join(SCHEMES)})")
    regex = pattern[3:] if pattern.startswith("re:") else pattern
    try:
        compiled = re.compile(regex)
    except re.error as exc:
        raise Fp4kitError(f"{what} {text!r}: {pattern!r} is not a valid regex: {exc}") from None
    return SchemeRule(compiled, scheme, text)


@dataclass(frozen=True)
class SchemeMap:
    """The default scheme and the rules that override it, first match wins."""

    default: str
    rules: tuple[SchemeRule, ...] = ()

    @classmethod
    def parse(cls, default: str, rules: Iterable[str] = (), what: str = "--scheme-for") -> SchemeMap:
        if default not in SCHEMES:
            raise Fp4kitError(f"--scheme {default!r}: unknown scheme (choose from {', '.join(SCHEMES)})")
        return cls(default, tuple(parse_rule(r, what) for r in rules))

    @property
    def mixed(self) -> bool:
        return any(r.scheme != self.default for r in self.rules)

    def scheme_of(self, module: str) -> str:
        return self.rule_scheme(module) or self.default

    def rule_scheme(self, module: str) -> str | None:
        """The scheme of the first rule that matches ``module``; None when none does."""
        return next((rule.scheme for rule in self.rules if rule.pattern.search(module)), None)

    def group_scheme(self, modules: Sequence[str]) -> str:
        """The one scheme of modules quantized together (a fused group); an error naming two that disagree."""
        schemes = {m: self.scheme_of(m) for m in modules}
        first = modules[0]
        for module, scheme in schemes.items():
            if scheme != schemes[first]:
                raise Fp4kitError(
                    f"--scheme-for: {first} gets {schemes[first]} but {module} gets {scheme}; modules a kernel "
                    f"fuses must share one scheme (match them with one rule)"
                )
        return schemes[first]

    def unused_rules(self, modules: Iterable[str]) -> list[str]:
        """Rules that win for no module (most likely a typo in the regex)."""
        winners = set()
        modules = list(modules)
        for module in modules:
            for rule in self.rules:
                if rule.pattern.search(module):
                    winners.add(rule.spelled)
                    break
        return [r.spelled for r in self.rules if r.spelled not in winners]


def assign(groups: Iterable[QuantGroup], smap: SchemeMap, kept_as_stored: Iterable[str] = ()) -> dict[int, str]:
    """The scheme of each planned group (keyed by its index), every member of a fused group agreeing; an error
    for a rule that wins for no planned module (nor, ``kept_as_stored``, for an unquantized FP8 module it keeps as
    stored), as an ignore pattern that matches nothing would."""
    groups = list(groups)
    modules = [c.linear.module for g in groups for c in g.members]
    unused = smap.unused_rules([*modules, *kept_as_stored])
    if unused:
        raise Fp4kitError(f"--scheme-for {unused[0]!r}: matches no module that is quantized (see --ignore)")
    return {i: smap.group_scheme([c.linear.module for c in g.members]) for i, g in enumerate(groups)}


def module_schemes(groups: Iterable[QuantGroup], smap: SchemeMap, kept_as_stored: Iterable[str] = ()
                   ) -> dict[str, str]:
    """The scheme of every planned module (fused groups whole; see ``assign``)."""
    groups = list(groups)
    schemes = assign(groups, smap, kept_as_stored)
    return {c.linear.module: schemes[i] for i, g in enumerate(groups) for c in g.members}


def single_nvfp4(schemes: Iterable[str]) -> bool:
    """Whether the quantized modules all have one NVFP4 scheme: the output is then a plain NVFP4 checkpoint."""
    distinct = set(schemes)
    return len(distinct) <= 1 and distinct <= set(NVFP4_SCHEMES)
