"""Model workers behind plain-data calls: the draft worker and the target worker."""
from calid.workers.draft import DraftWorker
from calid.workers.messages import DraftResult, DraftTask, ScoreResult, ScoreTask, VerifyResult, VerifyTask
from calid.workers.target import TargetWorker

__all__ = ["DraftWorker", "TargetWorker", "DraftTask", "DraftResult", "VerifyTask", "VerifyResult", "ScoreTask",
           "ScoreResult"]
