"""Workers: model weights, the paged KV cache and the model runner on one device."""
