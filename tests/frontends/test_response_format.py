"""``response_format=`` (OpenAI's spelling) and ``structured_outputs=`` (vLLM's) to one constraint per
prompt, and ``hf-contbatch generate --response-format`` with per-line ``response_format``."""

from __future__ import annotations

import json

import pytest

from hf_contbatch.cli import main
from hf_contbatch.frontends.response_format import response_format_params, structured_outputs_per_prompt
from hf_contbatch.request import StructuredOutputsParams

from conftest import validate_json

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}


def test_openai_shapes_and_pydantic_models_become_structured_outputs():
    pydantic = pytest.importorskip("pydantic")

    class Answer(pydantic.BaseModel):
        answer: str

    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    assert response_format_params(fmt) == StructuredOutputsParams(json=SCHEMA)
    assert response_format_params({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    assert response_format_params({"type": "text"}) is None
    assert response_format_params(Answer).json == Answer.model_json_schema()
    for bad in ({"type": "json_schema"}, {"type": "yaml"}, "json", [SCHEMA]):
        with pytest.raises(ValueError, match="response_format"):
            response_format_params(bad)


def test_a_schema_the_grammar_library_refuses_names_the_argument_the_caller_wrote():
    from hf_contbatch.engine.structured import GrammarSpec

    bad = {"type": "nonsense"}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": bad}}
    with pytest.raises(ValueError, match=r"^`response_format` json is refused by xgrammar: .*nonsense"):
        GrammarSpec.parse(response_format_params(fmt))
    with pytest.raises(ValueError, match=r"^`structured_outputs` json is refused by xgrammar: .*nonsense"):
        GrammarSpec.parse({"json": bad})


def test_one_value_or_one_per_prompt():
    assert structured_outputs_per_prompt(None, None, 2) == [None, None]
    assert structured_outputs_per_prompt(None, {"regex": "a+"}, 2) == [StructuredOutputsParams(regex="a+")] * 2
    per_prompt = structured_outputs_per_prompt([{"type": "json_object"}, None], None, 2)
    assert per_prompt == [StructuredOutputsParams(json_object=True), None]
    with pytest.raises(ValueError, match="2 prompts"):
        structured_outputs_per_prompt(None, [{"regex": "a"}], 2)
    with pytest.raises(ValueError, match="not both"):
        structured_outputs_per_prompt({"type": "json_object"}, {"regex": "a"}, 1)


@pytest.mark.timeout(900)
def test_cli_response_format_file_and_per_line_response_format(tmp_path, capsys):
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA), encoding="utf-8")  # a bare schema
    line_fmt = {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 0, "maximum": 9}},
    }
    inp = tmp_path / "prompts.jsonl"
    inp.write_text(
        json.dumps({"prompt": "Is it?"})
        + "\n"
        + json.dumps({"prompt": "A digit:", "response_format": line_fmt})
        + "\n",
        encoding="utf-8",
    )
    out = tmp_path / "out.jsonl"
    args = ["generate", "--input", str(inp), "--output", str(out), "--response-format", str(tmp_path / "schema.json")]
    assert main([*args, "--max-new-tokens", "32", "--quiet"]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    validate_json(json.loads(rows[0]["generated_text"]), SCHEMA)
    assert 0 <= json.loads(rows[1]["generated_text"]) <= 9
    with pytest.raises(SystemExit) as exit_info:  # one error line naming the file, exit status 2
        main(["generate", "--response-format", str(tmp_path / "missing.json")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith("missing.json: no such file")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "bad, says",
    [
        ({"type": "json_schema"}, "needs 'json_schema'"),  # the OpenAI shape without its schema
        ({"type": "wat"}, 'Unsupported type "wat"'),  # a bare schema the grammar library refuses
    ],
)
def test_cli_a_bad_response_format_on_a_jsonl_line_is_an_error_record_naming_the_line(tmp_path, bad, says):
    # A bad row is an error record of its own; the other rows run and the exit status is 3.
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    lines = [{"prompt": "A", "response_format": {"type": "json_object"}}, {"prompt": "B", "response_format": bad}]
    inp.write_text("\n".join(json.dumps(line) for line in lines) + "\n", encoding="utf-8")
    assert main(["generate", "--input", str(inp), "--output", str(out), "--max-new-tokens", "4", "--quiet"]) == 3
    good, failed = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert good["index"] == 0 and "generated_text" in good and "error" not in good
    assert failed["index"] == 1 and "generated_text" not in failed
    assert failed["error"].startswith("line 2: ") and says in failed["error"], failed
