"""Post-training: supervised fine-tuning on chat data and RL with partial rollouts.

    chat.py       the chat template (role headers framed by <|bos|> ... <|eos|>) and its training mask
    sft_data.py   chat JSON lines -> SFT indexed dataset + mask twin -> packed rows of whole conversations
    demo_sft.py   the built-in chat corpus (data=demo_sft) and its verifiable tasks
"""
