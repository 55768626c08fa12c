"""Top-1 accuracy as an ``evaluate`` metric module, loaded by path so it works offline.

``evaluate.load("accuracy")`` fetches its script from the Hub; this file is the same metric kept in
the repository: ``evaluate.load("training/metrics/accuracy")``.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Top-1 accuracy: the fraction of predictions equal to the references."
_CITATION = ""
_KWARGS_DESCRIPTION = "predictions: list of int, references: list of int"


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        predictions = np.asarray(predictions)
        references = np.asarray(references)
        return {"accuracy": float((predictions == references).mean()) if len(references) else 0.0}
