"""aiayn: the Transformer of "Attention Is All You Need", faithful by default, tested and fast.

The modules in layers, bottom to top. A module imports only from layers below its own, so data flows
one way (tests/test_layers.py holds the code to this table):

    files precision distributed      writing results safely; device and number format; torchrun's ranks
    config tokenizer                 frozen configs and presets; vocabularies and the special ids
    model synthetic                  the Transformer (§3); the demo's generated task
    data search checkpoint           reading and batching text; search over ids; model directories;
    compiled shortlist               the compiled decoding step; the output-layer shortlist
    prepare translate                a corpus as memory-mapped ids; text in, text out
    run evaluate                     a training run's directory; sacreBLEU
    train export keras_model plots   the training loop; CTranslate2; the model in Keras 3; pictures
    demo server                      the built-in job; the HTTP API and page
    cli                              the command line
    __main__                         python -m aiayn (what torchrun runs)
"""

from aiayn.config import ModelConfig, SearchConfig, TrainConfig, preset

__all__ = ["ModelConfig", "TrainConfig", "SearchConfig", "preset"]
