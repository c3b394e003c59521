"""What a request gets back: RequestOutputs (outputs), made from the sequences of a step by
the output processor (processor), which detokenizes incrementally (detokenizer) and cuts
the text at stop strings (stop_strings)."""
