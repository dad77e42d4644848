"""A user's app: their own MLP, MNIST loading and evaluation; our DP-IADMM (ObjPM) strategy and client."""
