"""A healthy multi-loss model from a real package (issue 16): a BERT pre-training model (``transformers``,
tiny config, random init, nothing downloaded) with its two heads' losses as terms, compiled with
aot_eager (and inductor), gives no error finding. Skips without transformers."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gradprobe  # noqa: E402

pytestmark = pytest.mark.real_packages


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForPreTraining(config).double()


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "labels": labels,
            "next_sentence_label": torch.tensor([0, 1])}  # fmt: skip


def _step(model, batch):  # type: ignore[no-untyped-def]
    out = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"])
    mlm = torch.nn.functional.cross_entropy(out.prediction_logits.flatten(0, 1), batch["labels"].flatten())
    nsp = torch.nn.functional.cross_entropy(out.seq_relationship_logits, batch["next_sentence_label"])
    return {"mlm": mlm, "nsp": nsp}


def _no_errors(variants: str) -> gradprobe.FlowMap:
    fm = gradprobe.probe(_model(), _step, _batch(), variants=variants, progress=False)
    assert [f.cause for f in fm.findings if f.severity == "error"] == [] and fm.exit_code == 0
    for v in fm.variant_names[1:]:
        for s in fm.scenario_names:
            assert fm.run(v, s).error is None and not fm.differences(v, s)
            assert fm.count(v, s) == fm.count("eager", s)
    return fm


def test_bert_compiled_with_aot_eager_has_no_error_finding() -> None:
    fm = _no_errors("eager,compile_model:aot_eager,compile:aot_eager")
    # The MLM head reaches the encoder; the NSP term reaches the pooler, which MLM does not.
    assert fm.count("eager", "nsp only")[0] < fm.count("eager", "all")[0]


@pytest.mark.inductor
def test_bert_compiled_with_inductor_has_no_error_finding() -> None:
    _no_errors("eager,compile_model:inductor")
