"""The sections of the trainer's config (`megamoe.train.config.TrainConfig`), one module each;
every section validates its own fields in `__post_init__`."""
