"""DataConfig: defaults build the embedded demo's data; bad values name the key."""

import pytest

from megatron_gspo.data import DataConfig, load_datasets


def test_defaults_load_the_embedded_task():
    config = DataConfig(train_size=64, heldout_size=16)
    train, heldout = load_datasets(config)
    assert len(train) == 64 and len(heldout) == 16
    assert not {i.prompt for i in train} & {i.prompt for i in heldout}
    assert load_datasets(DataConfig(heldout=None, train_size=8))[1] is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"train": "task:add7"}, "data.train='task:add7' names an unknown task; known: add2"),
        ({"heldout": "eval.csv"}, "data.heldout='eval.csv' must be a .jsonl or .parquet file"),
        ({"heldout_size": 0}, "data.heldout_size=0 must be an integer > 0"),
        ({"train_size": -1}, "data.train_size=-1 must be an integer > 0"),
        ({"tokenizer": "char:"}, "data.tokenizer='char:' has an empty alphabet"),
        ({"prompt_template": "Q:"}, r"data.prompt_template='Q:' must contain \{prompt\}"),
        ({"reward": "exactmatch"}, "data.reward='exactmatch' is not a registered reward; use one of"),
        ({"reward": "pkg.mod:"}, "data.reward='pkg.mod:' must look like 'package.module:function'"),
        ({"seed": -2}, "data.seed=-2 must be an integer >= 0"),
    ],
)
def test_invalid_values_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**overrides)


def test_file_sources_and_user_rewards_are_accepted_without_loading():
    config = DataConfig(train="/data/train.parquet", heldout="eval.jsonl", reward="my_pkg.rewards:score")
    assert config.reward == "my_pkg.rewards:score"
