"""One module per case: the reproduction and its fixes as plain, copyable functions."""
