"""A vision-language model in MLflow: MLflow 3.17's transformers flavor builds no image-text-to-text pipeline (it
refuses LlavaForConditionalGeneration with its processor), so the Hugging Face folder is logged as a pyfunc model's
artifact, `artifacts/model/` (what transformers' AutoModelForImageTextToText and AutoProcessor load), and predict
answers {"question", "image"} rows greedily.

    mlflow.pyfunc.load_model("models:/rayspeed-tiny-vision-cpu/1").predict(
        pandas.DataFrame([{"question": "What colour is the shape?", "image": "img/0001.png"}]))
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc

ARTIFACT = "model"
MAX_NEW_TOKENS = 32


class ImageTextModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context: Any) -> None:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        path = context.artifacts[ARTIFACT]
        self.processor = AutoProcessor.from_pretrained(path)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()

    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]  # MLflow reads hints
        rows = model_input.to_dict("records") if hasattr(model_input, "to_dict") else list(model_input)
        return [answer(self.model, self.processor, str(r["question"]), r.get("image")) for r in rows]


def answer(model: Any, processor: Any, question: str, image: Any = None, max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    """The model's greedy answer to a question about an image (a path or a PIL image; None: text alone)."""
    import torch
    from PIL import Image

    parts: list[dict[str, Any]] = [{"type": "image"}] if image is not None else []
    text = processor.apply_chat_template([{"role": "user", "content": parts + [{"type": "text", "text": question}]}],
                                         tokenize=False, add_generation_prompt=True)
    images = None if image is None else [image if isinstance(image, Image.Image) else
                                         Image.open(str(image)).convert("RGB")]
    inputs = processor(text=text, images=images, return_tensors="pt")
    tok = processor.tokenizer
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id)
    return str(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())
