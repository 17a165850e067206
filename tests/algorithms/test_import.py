"""`megatron_gspo.algorithms` stays pure PyTorch: importing it must not import megatron."""

import subprocess
import sys

CHECK = """
import sys
import megatron_gspo.algorithms as algorithms
loaded = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
assert not loaded, loaded
assert callable(algorithms.gspo_loss)
print("ok")
"""


def test_importing_algorithms_does_not_import_megatron():
    # A fresh interpreter: other tests in this session may already have imported megatron.
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_public_api_names():
    import megatron_gspo.algorithms as algorithms

    for name in ("group_advantages", "gspo_loss", "gspo_token_loss", "grpo_loss", "sequence_ratio",
                 "rollout_correction", "PolicyLossOutput", "gspo_loss_from_sums", "PolicyLossConfig",
                 "RolloutCorrectionConfig", "make_policy_loss", "PolicyLoss"):
        assert hasattr(algorithms, name), name
        assert name in algorithms.__all__, name
