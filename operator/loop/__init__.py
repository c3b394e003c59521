"""The closed loop: observe replicas, autoscale, idle to zero, tune engine knobs, judge trials."""
