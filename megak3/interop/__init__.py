"""Interoperation with the released Kimi-K3 Hugging Face checkpoint (``KimiK3ForConditionalGeneration``).

    hf_names.py     the state-dict adapter: one mapping table per layer kind between megak3's
                    canonical names and the HF names, on-disk shapes/dtypes, padding, expert split
    hf_config.py    config.json <-> ModelConfig (text_config, vision_config, quantization_config)
    mxfp4_pack.py   routed-expert MXFP4 pack/unpack (weight_packed / weight_scale), bit-exact with
                    the QAT fake-quant of megak3.quant.mx
    hf_load.py      ``load_hf_into(model, plan, path)``: the import behind ``train.init_from_hf``,
                    each rank reading only the slices of its plan boxes
    tools/convert_hf.py   the export (trainer checkpoint of any layout -> HF directory) and the key
                          inventory
"""
