"""The serving surface on the entry stage: the OpenAI API, its wire format, the chat page and the pipeline view."""
