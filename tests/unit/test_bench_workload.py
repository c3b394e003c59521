import pytest

from batchpilot.server.bench.workload import (
    ENGLISH_PROMPTS,
    make_workload,
    parse_int_list,
    seed_prompt,
)


def test_seed_prompt_is_the_documents_prompt():
    assert seed_prompt(1) == "请解释一下机器学习"
    assert seed_prompt(5) == "请解释一下" + "机器学习" * 5


def test_workload_is_fixed_by_its_seed_and_drawn_from_the_given_sets():
    w = make_workload(200, seed=3, output_lens=(8, 64), repeats=(1, 50))
    assert w == make_workload(200, seed=3, output_lens=(8, 64), repeats=(1, 50))
    assert w != make_workload(200, seed=4, output_lens=(8, 64), repeats=(1, 50))
    assert {r.output_len for r in w} == {8, 64}
    allowed = {seed_prompt(1), seed_prompt(50), *ENGLISH_PROMPTS}
    assert {r.prompt for r in w} == allowed  # 200 draws cover all six prompts


def test_parse_int_list():
    assert parse_int_list("16, 32,64") == (16, 32, 64)
    for bad in ("", "0,4", "a"):
        with pytest.raises(ValueError):
            parse_int_list(bad)
