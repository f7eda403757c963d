"""Logits of `tiny` and `tiny_linear`, reference and Pallas (interpret) paths, forward and cached
generation, against those stored in tests/data/golden_logits.npz: a change meant to keep behaviour
shows that it did. The reference entries were stored before the kernel-policy move (commit fb39a7c's
code), and the move kept every entry bitwise; the Pallas entries of `tiny` were made again when the
chunked KDA kernels began keeping float32 intermediates for float32 inputs (their distance to the
reference fell, e.g. batch-1 decode's third logits from 1.3 to 0.04 relative: `tiny`'s MXFP4 experts
read bf16 activations on that path, and its random router turns such rounding into other experts). The
entries whose path runs the reference chunked KDA were made again when its triangular solve became a
recursive 2 x 2 block inverse (LAPACK's solve deadlocked a 2-core CPU in training): they moved by rounding
only, 4e-7 to 1e-6 relative for `tiny_linear` and 8e-6 to 3e-5 for `tiny`.
Bitwise on a machine like the one that stored them (same JAX, CPU model, cache and instruction sets).
Elsewhere XLA's CPU code may sum in another order: there the entries whose paths keep float32 are
compared at the tolerances the generation tests use for these presets, and `tiny`'s Pallas entries not
at all (its MXFP4 kernels round activations to bf16, and its random router turns a flipped rounding into
other experts: no bound short of the logits' own size would hold)."""

import numpy as np

import golden_logits
from reference_numpy import rel_err

FLOAT32_TOLERANCE = {"tiny": 5e-3, "tiny_linear": 5e-5}  # as tests/test_inference.py's decode-against-forward


def test_logits_equal_the_stored_ones():
    stored = np.load(golden_logits.PATH)
    now = golden_logits.compute()
    assert sorted(now) == sorted(k for k in stored.files if k != "fingerprint")
    same_machine = str(stored["fingerprint"]) == golden_logits.fingerprint()
    for key, logits in now.items():
        preset, implementation = key.split("/")[:2]
        if same_machine:
            np.testing.assert_array_equal(logits, stored[key], err_msg=key)
        elif not (preset == "tiny" and implementation == "pallas"):
            assert rel_err(logits, stored[key]) < FLOAT32_TOLERANCE[preset], key
