"""The megak3 chat template: conversations as token ids, with a mask of the tokens SFT trains on.

Every message is framed by the tokenizer's reserved ids, with the role name as ordinary text::

    <|bos|> role "\\n" content <|eos|>        (role: system | user | assistant | tool)

so the template needs no new vocabulary and works with every megak3 tokenizer (ids 0-3 are
reserved: <|pad|> <|bos|> <|eos|> <|media|>, megak3/data/tokenizer.py). The pieces are encoded
separately and concatenated as ids, so the framing never depends on how BPE merges across a
boundary. A generation prompt ends with the open assistant header ``<|bos|> assistant "\\n"``; the
model's answer ends with ``<|eos|>``, which the generation engine always treats as a stop.

Training mask: the content tokens of every assistant message and its closing ``<|eos|>`` (the
model must learn to stop); everything else (system/user/tool messages, every role header) is
context only.

Images: a message may carry ``"images": ["a.png", ...]``; each image becomes as many ``<|media|>``
ids as the vision tower produces for it (``image_tokens``, in conversation order: megak3/model/vision.py
num_image_tokens of the fitted size), placed after the message's role header and before its content, in
order. Media ids are never trained on (mask 0, also in assistant messages); the last slot of an image
predicts the text after it only where that text is trained on.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

ROLES = ("system", "user", "assistant", "tool")
TRAINED_ROLE = "assistant"


class ChatFormatError(ValueError):
    """A conversation does not follow the chat JSON-lines format; the message names the fix."""


def check_messages(messages, where: str = "conversation") -> List[dict]:
    """Return ``messages`` as a list of ``{"role", "content"}`` dicts, or raise :class:`ChatFormatError`."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatFormatError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ChatFormatError(f"{where}: messages[{i}].role={m['role']!r} must be one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ChatFormatError(f"{where}: messages[{i}].content must be a string")
        imgs = m.get("images") or []
        if not isinstance(imgs, list) or not all(isinstance(p, str) and p for p in imgs):
            raise ChatFormatError(f"{where}: messages[{i}].images must be a list of image file paths")
        out.append({"role": m["role"], "content": m["content"], **({"images": list(imgs)} if imgs else {})})
    return out


def conversation_images(messages: Sequence[dict]) -> List[str]:
    """The image paths of a conversation, in the order their slots appear."""
    return [p for m in messages for p in m.get("images", ())]


def _header(tokenizer, role: str) -> List[int]:
    return [tokenizer.bos_id] + tokenizer.encode(role + "\n")


def encode_chat(tokenizer, messages: Sequence[dict], image_tokens: Sequence[int] = ()) -> Tuple[List[int], List[int]]:
    """``(ids, mask)`` of a whole conversation: ``mask[i] = 1`` where ``ids[i]`` is trained on.
    ``image_tokens``: the ``<|media|>`` slot count of each image of the conversation, in order."""
    msgs = check_messages(list(messages))
    n_img = len(conversation_images(msgs))
    if n_img != len(image_tokens):
        raise ChatFormatError(f"conversation has {n_img} images but {len(image_tokens)} image token counts were given")
    ids: List[int] = []
    mask: List[int] = []
    k = 0
    for m in msgs:
        head = _header(tokenizer, m["role"])
        media: List[int] = []
        for _ in m.get("images", ()):
            media += [tokenizer.media_id] * int(image_tokens[k])
            k += 1
        body = tokenizer.encode(m["content"]) + [tokenizer.eos_id]
        trained = 1 if m["role"] == TRAINED_ROLE else 0
        ids += head + media + body
        mask += [0] * (len(head) + len(media)) + [trained] * len(body)
    return ids, mask


def generation_prompt(tokenizer, messages: Sequence[dict], image_tokens: Sequence[int] = ()) -> List[int]:
    """Ids of ``messages`` followed by the open assistant header: what the engine continues
    (``image_tokens`` as in :func:`encode_chat`)."""
    ids, _ = encode_chat(tokenizer, messages, image_tokens) if messages else ([], [])
    return ids + _header(tokenizer, TRAINED_ROLE)


def render_chat_text(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The template as text, the reserved ids written as their token strings (``<|bos|>user\n...
    <|eos|>``), for APIs that pass prompts as strings (lm-eval's chat template). Without
    ``add_generation_prompt`` the last message is left open (no ``<|eos|>``) to be continued.
    :func:`encode_chat_text` turns it back into exactly :func:`generation_prompt`'s ids."""
    bos, eos = (tokenizer.hf.id_to_token(i) for i in (tokenizer.bos_id, tokenizer.eos_id))
    msgs = check_messages(list(messages))
    if conversation_images(msgs):
        raise ChatFormatError("render_chat_text: messages with images have no text form; use encode_chat")
    text = "".join(f"{bos}{m['role']}\n{m['content']}{eos}" for m in msgs)
    return text + f"{bos}{TRAINED_ROLE}\n" if add_generation_prompt else text[: -len(eos)]


def encode_chat_text(tokenizer, text: str) -> List[int]:
    """Ids of a :func:`render_chat_text` string: the reserved token strings become their ids, each
    role header (up to its first newline) and each content are encoded separately, as
    :func:`encode_chat` does. Text without reserved strings is encoded as usual."""
    bos, eos = (tokenizer.hf.id_to_token(i) for i in (tokenizer.bos_id, tokenizer.eos_id))
    ids: List[int] = []
    for j, turn in enumerate(text.split(bos)):
        if j == 0:
            ids += tokenizer.encode(turn) if turn else []
            continue
        head, nl, rest = turn.partition("\n")
        ids += [tokenizer.bos_id] + tokenizer.encode(head + nl)
        content, closed, tail = rest.partition(eos)
        ids += tokenizer.encode(content) if content else []
        if closed:
            ids.append(tokenizer.eos_id)
            ids += tokenizer.encode(tail) if tail else []
    return ids


def labels_from_mask(ids: Sequence[int], mask: Sequence[int], ignore_index: int = -100) -> List[int]:
    """Next-token labels of one conversation: ``labels[j] = ids[j+1]`` where ``mask[j+1]``, else ignored."""
    n = len(ids)
    return [ids[j + 1] if j + 1 < n and mask[j + 1] else ignore_index for j in range(n)]
