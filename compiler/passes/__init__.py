"""Graph passes, one per module, each a plain function over an fx GraphModule."""
