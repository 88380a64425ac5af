"""Model implementations (Llama family) and weight loading."""
