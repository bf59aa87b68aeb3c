"""The offline prepare job: raw image-caption sources filtered, encoded once into latents and written to the
latent store by resolution bucket (``job.prepare``; Ray Data plan in ``plan``). Training never imports it."""
