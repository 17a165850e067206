"""Prompt datasets from jsonl / parquet / tasks, and their error messages."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_gspo.data import DatasetError, PromptItem, load_prompt_dataset


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_jsonl_rows_become_items_with_meta(tmp_path):
    path = write_lines(
        tmp_path / "train.jsonl",
        [
            json.dumps({"prompt": "1+1=", "answer": "2", "level": 1}),
            "",
            "   ",
            json.dumps({"prompt": "half?", "answer": 0.5}),
            json.dumps({"prompt": "three", "answer": 3, "tags": ["x"]}),
        ],
    )
    data = load_prompt_dataset(path)
    assert len(data) == 3
    assert data[0] == PromptItem("1+1=", "2", {"level": 1})
    assert [item.answer for item in data] == ["2", "0.5", "3"]
    assert data[2].meta == {"tags": ["x"]}
    assert data.source == path


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "p"}', ":3: missing required field 'answer'"),
        ('{"answer": "a"}', ":3: missing required field 'prompt'"),
        ('{"prompt": "p", "answer": "a"', ":3: invalid JSON ("),
        ('["p", "a"]', ":3: expected a JSON object, got list"),
        ('{"prompt": 7, "answer": "a"}', ":3: field 'prompt' must be a string, got int"),
        ('{"prompt": "", "answer": "a"}', ":3: field 'prompt' is empty"),
        ('{"prompt": "p", "answer": null}', ":3: field 'answer' must be a string or number, got null"),
        ('{"prompt": "p", "answer": true}', ":3: field 'answer' must be a string or number, got bool"),
        ('{"prompt": "p", "answer": NaN}', ":3: field 'answer' is nan"),
    ],
)
def test_jsonl_malformed_row_names_file_and_line(tmp_path, bad_line, message):
    good = json.dumps({"prompt": "p", "answer": "a"})
    # Line 2 is blank: line numbers count every physical line, blank ones included.
    path = write_lines(tmp_path / "train.jsonl", [good, "", bad_line, good])
    with pytest.raises(DatasetError) as info:
        load_prompt_dataset(path)
    assert str(info.value).startswith(path + message)


def test_jsonl_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "p", "answer": "a"}\n{"prompt": "\xff", "answer": "a"}\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: not valid UTF-8"):
        load_prompt_dataset(str(path))


def test_parquet_rows_and_errors(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [1, 2], "source": ["x", "y"]}), path)
    data = load_prompt_dataset(path)
    assert list(data) == [PromptItem("a", "1", {"source": "x"}), PromptItem("b", "2", {"source": "y"})]

    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": ["1", "2", None]}), nulls)
    with pytest.raises(DatasetError, match=r"nulls\.parquet: row 2: field 'answer' must be a string or"):
        load_prompt_dataset(nulls)

    no_answer = tmp_path / "no_answer.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "solution": ["1"]}), no_answer)
    message = r"no_answer\.parquet: missing required column 'answer' \(columns: prompt, solution\)"
    with pytest.raises(DatasetError, match=message):
        load_prompt_dataset(no_answer)

    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("not parquet")
    with pytest.raises(DatasetError, match=r"garbage\.parquet: not a readable parquet file"):
        load_prompt_dataset(garbage)


def test_unsupported_missing_and_empty_files(tmp_path):
    with pytest.raises(DatasetError, match=r"data\.csv: unsupported dataset"):
        load_prompt_dataset(tmp_path / "data.csv")
    with pytest.raises(DatasetError, match=r"absent\.jsonl: file not found"):
        load_prompt_dataset(tmp_path / "absent.jsonl")
    empty = write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DatasetError, match="no prompts"):
        load_prompt_dataset(empty)


def test_size_truncates_files_and_template_wraps(tmp_path):
    rows = [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(5)]
    path = write_lines(tmp_path / "d.jsonl", rows)
    assert [item.prompt for item in load_prompt_dataset(path, size=2)] == ["q0", "q1"]
    assert len(load_prompt_dataset(path, size=50)) == 5

    template = "User: {prompt} Put the answer in \\boxed{}.\nAssistant:"
    item = load_prompt_dataset(path, prompt_template=template)[3]
    assert item.prompt == "User: q3 Put the answer in \\boxed{}.\nAssistant:"
    assert item.meta["raw_prompt"] == "q3" and item.answer == "3"
    with pytest.raises(ValueError, match=r"must contain \{prompt\}"):
        load_prompt_dataset(path, prompt_template="no field")


def test_task_spec_builds_split_of_given_size():
    data = load_prompt_dataset("task:add2", split="heldout", size=10, seed=3)
    assert len(data) == 10
    assert all(item.meta == {"task": "add2", "split": "heldout"} for item in data)
    with pytest.raises(ValueError, match="needs a size"):
        load_prompt_dataset("task:add2")
    with pytest.raises(ValueError, match="unknown task 'nope'; known tasks: add2, add3"):
        load_prompt_dataset("task:nope", size=1)
