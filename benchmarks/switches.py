"""Variant switches of the A/B benchmarks (``decode_variants.py``, ``prefill_variants.py``): each change
is a module attribute read while a step is traced, with the value that turns the change off; each
candidate (a form not yet taken by default) an attribute with the value that turns it on."""

from __future__ import annotations

import argparse


class Switches:
    """``off``: a change's name -> (owner, attribute, value with the change off); ``candidates``: a
    candidate's name -> (owner, attribute, value with it on). Variants: "default" (every change on, no
    candidate), each change off alone and each candidate on alone (by its name), "all off" (every change
    off, no candidate), "all candidates" (every change and every candidate on, where each candidate sets an
    attribute of its own)."""

    def __init__(self, off: dict[str, tuple[object, str, object]],
                 candidates: dict[str, tuple[object, str, object]] | None = None):
        self.settings = {**off, **(candidates or {})}  # name -> (owner, attribute, value its variant sets)
        self.original = {name: getattr(owner, attribute) for name, (owner, attribute, _) in self.settings.items()}
        self.variants = {"default": (), **{name: (name,) for name in self.settings}, "all off": tuple(off)}
        if candidates and len({(id(owner), attribute) for owner, attribute, _ in candidates.values()}) == len(candidates):
            self.variants["all candidates"] = tuple(candidates)  # only where no two candidates set one attribute

    def use(self, variant: str) -> None:
        """Set the attributes for a variant (its switches set, the others as they were), for the next trace."""
        for name, (owner, attribute, _) in self.settings.items():  # every attribute back first: several
            setattr(owner, attribute, self.original[name])  # settings may share one (a call's XLA options)
        for name in self.variants[variant]:
            owner, attribute, value = self.settings[name]
            setattr(owner, attribute, value)

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


def command_buffer_candidates(owner: object, attribute: str) -> dict[str, tuple[object, str, dict]]:
    """Candidates on a jitted call's XLA options (``owner.attribute``, a dict, as it is now) for how its command
    buffer (CUDA graph) is launched. XLA records each command's buffer addresses into the graph and, on a call
    whose arguments, outputs or temporaries moved, updates the commands that use them before the launch, on the
    host while the GPU may wait. JAX 0.11's XLA can give temporaries (``SKIP_TEMP``) or every stable buffer
    (``SKIP_PROFILED``, after three profiling calls) fixed virtual addresses so those updates are skipped (JAX
    0.10's refuses these values), and an exclusive lock on the GPU lets it drop some of an update's bookkeeping."""
    base = dict(getattr(owner, attribute))
    options = {
        "no command buffer": {"xla_gpu_enable_command_buffer": ""},
        "skip temp updates": {"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"},
        "skip profiled updates": {"xla_gpu_command_buffer_update_mode": "SKIP_PROFILED"},
        "exclusive lock": {"xla_gpu_require_exclusive_lock": True},
    }
    return {name: (owner, attribute, {**base, **extra}) for name, extra in options.items()}
