"""Variant switches of the A/B benchmarks (``decode_variants.py``, ``prefill_variants.py``): each change
is a module attribute read while a step is traced, with the value that turns the change off; each
candidate (a form not yet taken by default) an attribute with the value that turns it on."""

from __future__ import annotations

import argparse


class Switches:
    """``off``: a change's name -> (owner, attribute, value with the change off); ``candidates``: a
    candidate's name -> (owner, attribute, value with it on). Variants: "default" (every change on, no
    candidate), each change off alone and each candidate on alone (by its name), "all off" (every change
    off, no candidate), "all candidates" (every change and every candidate on)."""

    def __init__(self, off: dict[str, tuple[object, str, object]],
                 candidates: dict[str, tuple[object, str, object]] | None = None):
        self.settings = {**off, **(candidates or {})}  # name -> (owner, attribute, value its variant sets)
        self.original = {name: getattr(owner, attribute) for name, (owner, attribute, _) in self.settings.items()}
        self.variants = {"default": (), **{name: (name,) for name in self.settings}, "all off": tuple(off)}
        if candidates:
            self.variants["all candidates"] = tuple(candidates)

    def use(self, variant: str) -> None:
        """Set the attributes for a variant (its switches set, the others as they were), for the next trace."""
        for name, (owner, attribute, value) in self.settings.items():
            setattr(owner, attribute, value if name in self.variants[variant] else self.original[name])

    def arguments(self, doc: str) -> argparse.ArgumentParser:
        """A command line of a preset (default mini) and variants, described by the script's ``doc``'s
        first paragraph; the script adds its own options."""
        ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
        ap.add_argument("preset", nargs="?", default="mini")
        ap.add_argument("variants", nargs="*", help=f"from {sorted(self.variants)}, 'default' among them "
                                                    "(default: all)")
        return ap

    def chosen(self, names: list[str]) -> list[str]:
        """The variants named on a command line (all of them when none is), 'default' among them."""
        names = names or list(self.variants)
        unknown = sorted(set(names) - set(self.variants))
        if unknown or "default" not in names:
            raise SystemExit(f"variants must include 'default' and come from {sorted(self.variants)}; "
                             f"unknown: {unknown}")
        return names
