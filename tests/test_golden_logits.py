"""Logits of `tiny` and `tiny_linear`, reference and Pallas (interpret) paths, forward and cached
generation, against those stored in tests/data/golden_logits.npz before the kernel-policy move
(commit fb39a7c's code). Bitwise on the machine kind that stored them (same JAX, same CPU instruction
sets); elsewhere XLA's CPU code may sum in another order, so there to float32 rounding."""

import numpy as np

import golden_logits


def test_logits_equal_the_stored_ones():
    stored = np.load(golden_logits.PATH)
    now = golden_logits.compute()
    assert sorted(now) == sorted(k for k in stored.files if k != "fingerprint")
    same_machine = str(stored["fingerprint"]) == golden_logits.fingerprint()
    for key, logits in now.items():
        if same_machine:
            np.testing.assert_array_equal(logits, stored[key], err_msg=key)
        else:
            np.testing.assert_allclose(logits, stored[key], rtol=2e-5, atol=2e-5, err_msg=key)
