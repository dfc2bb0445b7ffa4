"""Ask a chat model a question: a registered MLflow version (models:/<name>/<version|latest>) or a Hugging Face
directory, loaded with transformers, prompted through its chat template, answered greedily; with --image, a question
about a picture to a vision-language model (its processor's template and image processing).

    python scripts/chat_generate.py models:/rayspeed-tiny-chat-finetune-cpu/latest "What is the capital of Italy?"
    python scripts/chat_generate.py runs/examples/tiny-chat/model "What color is the sky?"
    python scripts/chat_generate.py models:/rayspeed-tiny-vision-cpu/latest "What colour is the shape?" \
        --image runs/examples/tiny-vision/shapes/img/0400.png

Tracking store: MLFLOW_TRACKING_URI, else the repository's mlflow.db (RAYSPEED_HOME, else this checkout).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform"))


def model_dirs(ref: str, tracking_uri: str, dst: str) -> tuple[str, str]:
    """(model directory, tokenizer directory) of a registered version (models:/<name>/<version|latest>) or a
    directory. MLflow's transformers flavor keeps the tokenizer beside the model, under components/tokenizer. The
    store is read through its own client: no process-wide MLflow setting is changed."""
    if not ref.startswith("models:/"):
        return ref, ref
    import mlflow
    from mlflow import MlflowClient

    name, _, version = ref[len("models:/"):].partition("/")
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    if version in ("", "latest"):
        version = str(max(int(v.version) for v in client.search_model_versions(f"name = '{name}'")))
    source = client.get_model_version(name, version).source
    if source.startswith("models:/m-"):  # an MLflow 3 logged model
        source = client.get_logged_model(source[len("models:/"):]).artifact_location
    local = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=dst)
    if os.path.isdir(os.path.join(local, "artifacts", "model")):  # a vision-language model, logged as pyfunc
        return os.path.join(local, "artifacts", "model"), os.path.join(local, "artifacts", "model")
    tok = os.path.join(local, "components", "tokenizer")
    return os.path.join(local, "model"), tok if os.path.isdir(tok) else os.path.join(local, "model")


def answer(directory: str, question: str, max_new_tokens: int = 32, tokenizer_dir: str | None = None) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir or directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    # Every stop id the model's generation_config.json names (Qwen3 and Gemma 3 end a turn with another token than
    # their tokenizer's EOS), and the tokenizer's.
    stops = model.generation_config.eos_token_id
    stops = [*(stops if isinstance(stops, list) else [stops] if stops is not None else [])]
    stops += [tok.eos_token_id] if tok.eos_token_id not in stops else []
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stops, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    return tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def image_answer(directory: str, question: str, image: str, max_new_tokens: int = 32) -> str:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rayspeed.tracking.image_text_model import answer as ask

    model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    return ask(model, AutoProcessor.from_pretrained(directory), question, image, max_new_tokens)


def main(argv: list[str] | None = None) -> int:
    from rayspeed.paths import MLFLOW_DB, home

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="models:/<name>/<version|latest> or a Hugging Face model directory")
    ap.add_argument("question")
    default_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / MLFLOW_DB}"
    ap.add_argument("--tracking-uri", default=default_uri)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--image", help="a picture the question is about (a vision-language model)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rayspeed-chat-") as tmp:
        d, t = model_dirs(a.model, a.tracking_uri, tmp)
        print(f"Q: {a.question}")
        given = image_answer(d, a.question, a.image, a.max_new_tokens) if a.image else \
            answer(d, a.question, a.max_new_tokens, t)
        print(f"A: {given}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
