"""Great Expectations suites (JSON) of the validation stage; a package so that wheels ship the files."""
