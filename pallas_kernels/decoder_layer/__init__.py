"""Llama decoder layers of a decode step as one native CPU call (`native.decoder_layers`)."""
