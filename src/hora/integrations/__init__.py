"""hora under other libraries' training loops: :mod:`hora.integrations.hf` (Hugging Face ``transformers.Trainer``).

Each module imports its library when it is imported, and names the hora extra that brings it when it is missing.
"""
