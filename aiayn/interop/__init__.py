"""Other runtimes: CTranslate2 and Keras 3."""
