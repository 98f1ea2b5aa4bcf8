"""The `aiayn` command line: thin wrappers that parse flags, check paths, build configs and call the library.
Every path and value is checked before the work it is for; a user's mistake is one `aiayn: error:` line
naming the file, line or value, with exit status 2.

    main        the parser, assembled from the groups below, and the one place errors become that line
    common      the flags and options several commands share (model, search, device, number format)
    train       prepare, train (alone or under torchrun), demo
    translate   translate, evaluate, score, plot
    models      average, shortlist, export
    serve       serve
"""
