"""The training job's configuration, below both megak3.train and megak3.launch (neither is imported here).

    megak3.job.config     JobConfig / TrainConfig: the schema, one dataclass per Hydra group, and validate()
    megak3.job.launcher   LauncherConfig (the ``launcher`` group) and LaunchJobConfig = JobConfig + launcher
    megak3.job.compose    Hydra's composition of conf/config.yaml, one-line ConfigError, check(argv)
    megak3.job.fields     the schema's dotted fields, types and docstrings (``--help``, "did you mean")
"""
